"""Test arrays."""
import numpy as np


def randn(*shape, seed=0):
    return np.random.RandomState(seed).standard_normal(shape)
