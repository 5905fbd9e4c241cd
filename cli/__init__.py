"""laneway's command line: parses arguments and renders results, nothing more."""

if __name__ != "laneway.cli":  # a second copy of every module, with its own state
    raise ImportError(f"import laneway.cli, not {__name__} (laneway is one namespace)")
