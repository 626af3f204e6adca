"""The commands: des.train's configuration (config) and run (job, train), the modes (modes: single,
des; the PS and cache modes live in des.baselines), --mode auto (auto), scoring (predict),
side-by-side comparisons (compare, projection, runs) and the verification helpers (verify)."""
