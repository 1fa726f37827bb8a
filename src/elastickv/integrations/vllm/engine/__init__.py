"""The engine core's side: connecting the scheduler to its workers, the ledger registration,
idle ticks, the parent watchdog and the start-up log."""
