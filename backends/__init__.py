"""Training backends: each turns agent rollouts and rewards into policy updates (`conf/backend/*.yaml`)."""
