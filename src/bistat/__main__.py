"""``python -m bistat``: the same as the ``bistat`` command."""

from bistat.cli import main

if __name__ == "__main__":
    main()
