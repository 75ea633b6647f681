"""Recurrent layers: LSTMUnit, LSTM and RNN (layers.py), caffe_ocr's Lstm (ocr_lstm.py),
and the CRNN ports' ContinuationIndicator, the sequence indicator the LSTMs read
(continuation_indicator.py)."""
