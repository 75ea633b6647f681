"""Recurrent layers: LSTMUnit, LSTM and RNN."""
