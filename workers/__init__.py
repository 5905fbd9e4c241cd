"""laneway's per-node worker service and the per-attempt supervisor."""

if __name__ != "laneway.workers":  # a second copy of every module, with its own state
    raise ImportError(f"import laneway.workers, not {__name__} (laneway is one namespace)")
