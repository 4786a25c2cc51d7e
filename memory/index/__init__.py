"""Indexing: chunking, embeddings, and the vector index with its per-user copies."""
