"""``python -m caffe_syncbn``: the caffe-syncbn command (cli.py)."""
from .cli import console_main

console_main()
