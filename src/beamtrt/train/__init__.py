"""DFlash2 drafter training: target answers with taps, the trainer, its evals and the draft vocabulary."""
