import sys

try:
  from ntk_fl import cli
  from ntk_fl.cli import __doc__  # noqa: F401  (--help prints the command's docstring)
except KeyboardInterrupt:  # Ctrl-C while the imports run: nothing was started
  sys.stderr.write("\ninterrupted; nothing was started\n")
  sys.exit(130)

if __name__ == "__main__":
  cli.main()
