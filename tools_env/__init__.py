"""Python tool environments (code sandbox, search, crawl, wiki search); imports nothing from coa_jax."""
