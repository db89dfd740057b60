"""Corpus sources, tokenizer, best-fit packing, document-aware collation, resumable loading."""
