"""The ``caffe-syncbn`` command (commands.py) and what the tools share: flags in gflags'
spellings, one error line, the device lines, timing, log parsing."""
from .commands import console_main, main

__all__ = ['console_main', 'main']
