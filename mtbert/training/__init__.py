"""The training loops and what they use: epoch selection, objective, SMART, PCGrad, optimiser, resume,
distributed."""
