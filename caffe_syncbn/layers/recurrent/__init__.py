"""Recurrent layers: LSTMUnit, LSTM and RNN (layers.py), and caffe_ocr's Lstm (ocr_lstm.py)."""
