"""laneway's controller: the ledger (every state write), admission policy and the daemon."""

if __name__ != "laneway.controller":  # a second copy of every module, with its own state
    raise ImportError(f"import laneway.controller, not {__name__} (laneway is one namespace)")
