"""The compute path: a micro-batch packed into one row, the decoder, the heads in token chunks."""
