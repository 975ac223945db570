"""`python -m specserve.kernels`: build the C++ kernels now (scripts/setup.sh runs this)."""
from . import build_dir, load

load(verbose=False)
print(f"specserve kernels built in {build_dir()}")
