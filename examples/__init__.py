"""Example LightningModules for lightning_vitscale (classification, detection, video), driven by LightningCLI."""
