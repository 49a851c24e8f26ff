"""ropescale's evaluation harness: data → windows → perplexity → sweep → reports."""
