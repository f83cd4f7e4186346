"""Target hardware profiles: plain data the placement and cost model read.

Bandwidths are sustained figures (GB/s) a decode step can expect, not datasheet peaks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from runtime.artifact import cpu_flags, format_size  # one definition each, the runtime's (it cannot import the compiler)

from .errors import UserError


GiB = 1 << 30


@dataclass(frozen=True)
class CpuIsa:
    """An x86 instruction set the CPU kernels can be generated for."""

    name: str
    mcpu: str  # the LLVM CPU the kernels are compiled for
    features: tuple[str, ...]  # /proc/cpuinfo flags the kernels need (the runtime checks them)
    gemm_panels: int  # 16-column weight panels per prefill GEMM register tile (12 ymm or 12 zmm accumulators)
    int8_dot: str = "madd"  # the integer dot product of int8-activation kernels: vpmaddubsw + vpmaddwd

    def llvm_target(self) -> dict:
        """The TVM target dict for code on this instruction set: the CPU kernels, and a CUDA module's host side."""
        return {"kind": "llvm", "mcpu": self.mcpu, "num-cores": LLVM_NUM_CORES}


LLVM_NUM_CORES = 2
"""`num-cores` of the LLVM targets: only a hint for TVM's tuners (kernels take their threads from the pool at run
time); the project's `cpu` machine has 2 cores."""

AVX512 = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl")

CPU_ISAS: dict[str, CpuIsa] = {
    isa.name: isa
    for isa in [
        CpuIsa("avx2", "haswell", ("avx2", "fma", "f16c"), 1),
        CpuIsa("avx512", "skylake-avx512", AVX512, 2),
        # AVX512-VNNI: int8-activation kernels use vpdpbusd (one instruction per 64 byte products instead of
        # vpmaddubsw + vpmaddwd). cascadelake is skylake-avx512 plus VNNI and nothing else, so LLVM emits no
        # instruction of the later AVX-512 extensions (VBMI, BITALG, ...) that a VNNI CPU may lack.
        CpuIsa("avx512vnni", "cascadelake", (*AVX512, "avx512_vnni"), 2, int8_dot="vnni"),
    ]
}


BASELINE_CPU_ISA = "avx2"  # what every CPU picompile supports has: portable artifacts


def host_cpu_isa() -> CpuIsa:
    """The widest of CPU_ISAS this machine's CPU has (the build machine's, which `--target` profiles do not
    fix: kernels for it are what a user who builds and runs on one machine wants). Where the CPU's flags
    cannot be read, the portable baseline; where the CPU lacks even that, a UserError (pass --cpu-isa to
    build for another machine)."""
    flags = cpu_flags()
    if flags is None:
        return CPU_ISAS[BASELINE_CPU_ISA]
    fitting = [isa for isa in CPU_ISAS.values() if set(isa.features) <= flags]
    if not fitting:
        raise UserError(f"this machine's CPU has none of the instruction sets picompile's CPU kernels are made for "
                        f"({', '.join(CPU_ISAS)}): pass --cpu-isa to build for another machine")
    return max(fitting, key=lambda isa: len(isa.features))


def get_cpu_isa(name: str) -> CpuIsa:
    try:
        return CPU_ISAS[name]
    except KeyError:
        raise UserError(f"unknown CPU instruction set {name!r}; choose one of {', '.join(CPU_ISAS)}") from None


RATES_VERSION = 5  # of the measured rates' meaning (passes/machine_rates.py measures them; a cache of another is
# measured again)


@dataclass(frozen=True)
class KernelRate:
    """One kernel kind in one format on this machine: the bytes it reads per second, plus a fixed cost per call and
    one per unit of its work: a GEMV's output column, a threshold call's kept row."""

    bytes_per_s: float
    call_s: float = 0.0
    unit_s: float = 0.0

    def seconds(self, read_bytes: float, units: float = 0) -> float:
        return read_bytes / self.bytes_per_s + self.call_s + units * self.unit_s


@dataclass(frozen=True)
class CpuRates:
    """The measured rates of one machine at `threads` threads: dense decode GEMVs and threshold calls by format."""

    key: str
    threads: int
    gemv: dict[str, KernelRate] = field(default_factory=dict)
    columns: dict[str, KernelRate] = field(default_factory=dict)
    busy: bool = False  # other programs took a core while they were measured (such figures are not cached)

    @property
    def stream_bytes_per_s(self) -> float:
        """What a plain read (a KV cache, a norm's weights) streams at: the fp32 GEMV's rate."""
        return self.gemv["fp32"].bytes_per_s

    def to_json(self) -> dict:
        return {"version": RATES_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> CpuRates:
        if data.get("version") != RATES_VERSION:
            raise ValueError(f"machine rates of version {data.get('version')}, not {RATES_VERSION}")
        rates = lambda entries: {name: KernelRate(**rate) for name, rate in entries.items()}  # noqa: E731
        return cls(data["key"], int(data["threads"]), rates(data["gemv"]), rates(data["columns"]),
                   bool(data.get("busy", False)))

    def lines(self) -> list[str]:
        lines = [f"machine {self.key} at {self.threads} thread{'s' if self.threads != 1 else ''}"
                 + (" (other programs took a core while it was measured: not cached)" if self.busy else "") + ":",
                 "  format  dense GEMV GB/s  call us  ns/output  threshold rows GB/s  call us  ns/unit"]
        for name, rate in self.gemv.items():
            column = self.columns.get(name)
            lines.append(f"  {name:<7} {rate.bytes_per_s / 1e9:15.1f}  {rate.call_s * 1e6:7.1f}  "
                         f"{rate.unit_s * 1e9:9.2f}  "
                         + (f"{column.bytes_per_s / 1e9:19.1f}  {column.call_s * 1e6:7.1f}  {column.unit_s * 1e9:6.1f}"
                            if column else f"{'-':>19}  {'-':>7}  {'-':>6}"))
        lines.append("  (a threshold call's unit: a kept row; over a file's own blocks, a block's output)")
        return lines


@dataclass(frozen=True)
class Target:
    name: str
    gpu_memory_bytes: int  # 0 for CPU-only targets
    gpu_bandwidth_gbs: float
    cpu_bandwidth_gbs: float
    pcie_bandwidth_gbs: float
    cuda_arch: str | None  # e.g. "sm_89"
    # the CPU_ISAS entry the CPU kernels are generated for unless the build says otherwise; None: the build
    # machine's (host_cpu_isa), as for every profile here: a target names a GPU and bandwidths, not a CPU
    cpu_isa: str | None = None
    # the build machine's CPU kernels as measured (passes.machine_rates; a build attaches them where it can time its
    # kernels): the cost model prices CPU reads with them, else with cpu_bandwidth_gbs
    cpu_rates: CpuRates | None = field(default=None, compare=False)

    @property
    def has_gpu(self) -> bool:
        return self.cuda_arch is not None


TARGETS: dict[str, Target] = {
    t.name: t
    for t in [
        # `cpu` is the project's 2-core machine: ~38 GB/s streaming reads (np.copyto moves ~19 GB/s each way)
        Target("cpu", 0, 0.0, 38.0, 0.0, None),
        Target("rtx4090", 24 * GiB, 900.0, 60.0, 25.0, "sm_89"),
        Target("rtx2080ti", 11 * GiB, 550.0, 40.0, 12.0, "sm_75"),
        Target("a100-80g", 80 * GiB, 1700.0, 60.0, 25.0, "sm_80"),
        Target("h200", 141 * GiB, 4000.0, 100.0, 50.0, "sm_90"),
    ]
}


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise UserError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}") from None


CUDA_ARCHS: tuple[str, ...] = tuple(sorted({t.cuda_arch for t in TARGETS.values() if t.cuda_arch}))
"""The SM architectures picompile builds GPU kernels for: those of the GPU targets."""

CUDA_HOST_ISA = CPU_ISAS[BASELINE_CPU_ISA]
"""The instruction set of a CUDA module's host code (argument packing and launches, nothing hot): the baseline
every supported x86 CPU runs."""


def cuda_target(arch: str) -> dict:
    """The TVM target dict for GPU kernels of `arch` ("sm_XX"): CUDA device code, CUDA_HOST_ISA host code."""
    if not (isinstance(arch, str) and arch.startswith("sm_") and arch[3:].isdigit()):
        raise ValueError(f"arch must look like 'sm_80', got {arch!r}")
    return {"kind": "cuda", "arch": arch, "host": CUDA_HOST_ISA.llvm_target()}


# Share of the GPU memory kept free for activations, kernel workspace and the allocator's slack.
RESERVE_FRACTION = 0.05


@dataclass(frozen=True)
class GpuBudget:
    """The GPU memory a build may fill: --vram-budget, else the target's memory (0 without a GPU), less a
    reserve (`reserve_fraction` of it) for activations, kernel workspace and the allocator's slack."""

    total_bytes: int
    reserve_fraction: float = RESERVE_FRACTION

    @classmethod
    def resolve(cls, target: Target, budget_bytes: int | None) -> "GpuBudget":
        """The budget for `target`; a --vram-budget the card cannot hold is refused (`check_vram_budget`)."""
        check_vram_budget(target, budget_bytes)
        return cls(budget_bytes if budget_bytes is not None else target.gpu_memory_bytes)

    @property
    def reserve_bytes(self) -> int:
        return int(self.total_bytes * self.reserve_fraction)

    @property
    def usable_bytes(self) -> int:
        """What placement may fill: the total less the reserve."""
        return self.total_bytes - self.reserve_bytes


def check_vram_budget(target: Target, budget_bytes: int | None) -> None:
    """--vram-budget must fit the target's GPU: refuse, with both numbers, a budget the card cannot hold."""
    if budget_bytes is None or budget_bytes <= target.gpu_memory_bytes:
        return
    raise UserError(
        f"--vram-budget {budget_bytes} bytes ({format_size(budget_bytes)}) exceeds the GPU memory of target "
        f"{target.name}: {target.gpu_memory_bytes} bytes ({format_size(target.gpu_memory_bytes)})"
        + ("; it has no GPU (choose a GPU --target)" if not target.has_gpu else ""))


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    """'8GiB', '512MiB', '1.5GB', '1000' -> bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise UserError(f"malformed size {text!r}: expected a number with an optional unit such as 8GiB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
