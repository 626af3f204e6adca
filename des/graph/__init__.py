"""The compiler's graph layer, the rule API: one canonical IR of a Keras model (ir), patterns over
it (pattern), field vectors and layouts (fields), table sources (sources: FieldEmbedding, TFRA,
Keras Embedding) and adapters for third-party layers (adapters). It imports nothing else of des;
rewrite_rules builds on it, des.compiler on both."""
