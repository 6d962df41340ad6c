"""engine.inference: sampling text from an opened checkpoint (`kforge generate`, and lm-eval's
generation requests). Opening the checkpoint is `engine.interop.open_checkpoint`; scoring is
`engine.evaluation`."""
