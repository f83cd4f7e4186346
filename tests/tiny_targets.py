"""GPU targets for tiny models. A tiny model's blocks are a few KiB: at a real card's bandwidths the calls' fixed
costs and the copies decide, and placement rightly keeps every block on the CPU. With a CPU this much slower, bytes
decide, as they do at real model sizes, so builds for it put blocks and hot neurons on the GPU (within the budget)
and the GPU and hybrid paths get tested."""

from __future__ import annotations

import dataclasses

from passes.targets import get_target

SLOW_CPU_RTX4090 = dataclasses.replace(get_target("rtx4090"), cpu_bandwidth_gbs=0.05)
