import time


def forward(gate, up):
    while True:
        time.sleep(1)
