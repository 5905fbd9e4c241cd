if __name__ != "laneway.migrations":  # a second copy of every module, with its own state
    raise ImportError(f"import laneway.migrations, not {__name__} (laneway is one namespace)")
