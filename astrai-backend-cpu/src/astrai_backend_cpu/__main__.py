"""``python -m astrai_backend_cpu``: build this machine's CPU kernels ahead of the first start
(``astrai_backend_cpu.build.main``)."""

import sys

from astrai_backend_cpu.build import main

if __name__ == "__main__":
    sys.exit(main())
