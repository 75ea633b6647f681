"""The ``caffe-syncbn`` command (commands.py) and what the tools share as front ends: flags
in gflags' spellings, one error line, the progress bar, the device lines. What they
compute (timings, peak memory, log tables) is the package's (analysis/)."""
from .commands import console_main, main

__all__ = ['console_main', 'main']
