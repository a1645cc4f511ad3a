import sys

from bench.trace import main

if __name__ == "__main__":
    sys.exit(main())
