"""What is written to disk: heads directories, exports, model cards, reply stores, atomic writes."""
