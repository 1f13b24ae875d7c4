"""On-policy distillation recipes beyond plain KL on the student's episodes (config section `recipe`)."""
