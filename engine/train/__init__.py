"""Training the shipped target model: stdlib corpus, BPE tokenizer, compressor baselines, DeepSeek-V3 trainer."""
