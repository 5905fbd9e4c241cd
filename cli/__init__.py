"""laneway's command line: parses arguments and renders results, nothing more."""
