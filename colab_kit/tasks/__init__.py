"""What the notebooks do with the kit: RNA classification (`rna`, a package of its own), causal-LM
text (`text`), the package versions the RNA notebook needs (`versions`) and a tiny demo run (`demo`).
Each notebook's parameters resolve to settings here (`rna.resolve_settings`, `text.resolve_settings`,
on the presets of `presets`), so that a notebook reads as a recipe."""
