"""``python -m laneway``: the ``laneway`` command, for an interpreter without the script
on its PATH (the background controller is started this way)."""

from laneway.cli.main import main

if __name__ == "__main__":
    main(prog_name="laneway")
