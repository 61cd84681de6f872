// The sending half of a client stream: messages pushed now, read by the transport as it sends.

export class Queue<T> implements AsyncIterable<T> {
  private readonly items: T[] = [];
  private ended = false;
  private wake: (() => void) | undefined;

  push(item: T): void {
    if (this.ended) {
      throw new Error("push after end");
    }
    this.items.push(item);
    this.wake?.();
  }

  /** No more messages: the stream is half-closed once those pushed are sent. */
  end(): void {
    this.ended = true;
    this.wake?.();
  }

  get isEnded(): boolean {
    return this.ended;
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<T> {
    for (;;) {
      const item = this.items.shift();
      if (item !== undefined) {
        yield item;
      } else if (this.ended) {
        return;
      } else {
        await new Promise<void>((resolve) => (this.wake = resolve));
        this.wake = undefined;
      }
    }
  }
}
