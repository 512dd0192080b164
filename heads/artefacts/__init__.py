"""What is written to disk: heads directories, model cards, exports, reply stores."""
