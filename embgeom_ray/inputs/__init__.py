"""From text to folded statistics, without Ray: corpus sources and the shard plan, windows and
batches, model and tokenizer loading, and the extractor that folds a shard's hidden states."""
