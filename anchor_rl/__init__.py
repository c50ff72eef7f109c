"""anchor-rl: RL from verifiable rewards with cheap, accurate advantage baselines."""

__version__ = "0.1.0"
