"""ArgMax and Reduction: layers that reduce axes of their bottom."""
