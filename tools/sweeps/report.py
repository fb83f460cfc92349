"""Output helpers shared by the sweeps: flushed log lines and a compiled kernel's resources."""


def log(*args):
    print(*args, flush=True)


def kernel_resources(kernel, on_simulator: bool) -> str:
    """'regs R, local L B, shared S B' of a compiled Numba kernel ('-' under the simulator)."""
    if on_simulator:
        return "-"

    def first(value):  # {signature: value} for a kernel compiled without an explicit signature
        return next(iter(value.values()), "?") if isinstance(value, dict) else value
    try:
        return (f"regs {first(kernel.get_regs_per_thread())}, local {first(kernel.get_local_mem_per_thread())} B, "
                f"shared {first(kernel.get_shared_mem_per_block())} B")
    except Exception as error:  # noqa: BLE001 - diagnostics only
        return f"(resources unavailable: {error})"
