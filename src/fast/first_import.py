"""What this process held when FAST was first imported (the package imports this module before anything else)."""

import sys

# torch came in before FAST did: its intra-op pool may have started then, which no later count of this process's
# threads can tell from the ones torch's import starts (fast.runtime.launch's rule for forking workers)
TORCH_CAME_FIRST = "torch" in sys.modules
