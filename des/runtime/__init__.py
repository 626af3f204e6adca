"""What a transformed model does after des.transform: rows with their optimizer slots (state),
checkpoints on any number of processes (checkpoint), save / save_weights of the untouched model
(saving), one SavedModel for serving (export) and the training callbacks (callbacks)."""
