"""Neuron layers: element-wise activations (ReLU, PReLU, ELU, Sigmoid, TanH, AbsVal,
BNLL, Power, Exp, Log, Threshold, Clip, the forks' ReLU6, Swish) and Dropout, with Bayesian
SegNet's Dropout that samples in TEST (sampled_dropout.py); relu and relu_gradient, which
the batch norms and Eltwise use in their fused chains."""
