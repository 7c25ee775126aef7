from ntk_fl import cli
from ntk_fl.cli import __doc__  # noqa: F401  (--help prints the command's docstring)

if __name__ == "__main__":
  cli.main()
