"""``python -m ntk_fl --config=ntk_dfl:smoke --workdir=runs/smoke``: the ``ntk-fl`` command."""
from ntk_fl import cli

if __name__ == "__main__":
  cli.main()
