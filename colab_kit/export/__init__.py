"""The exported model: `run.save_final`'s `final/` (`final`) and a LoRA run's merged model (`merge`)."""
