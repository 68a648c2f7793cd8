"""`python -m kernelgen.distributed --nproc-per-node N script.py args...`: see launch.py."""
import sys

from kernelgen.distributed.launch import main

if __name__ == "__main__":
    sys.exit(main())
