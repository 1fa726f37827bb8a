"""The scheduler's side: the elastic block pool, its per-step hooks, the store it grants pages
from, and the scheduler clock."""
