"""Scale and Bias (layers.py); SENet's Axpy (axpy.py), which is a Scale by one number per
channel followed by an addition."""
