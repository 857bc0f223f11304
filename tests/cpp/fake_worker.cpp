// A worker for test_worker_pool: one command per stdin line, misbehaving on request.
//   echo X        answers X                     env NAME     answers $NAME or "<unset>"
//   segv          raises SIGSEGV                abort        std::abort()
//   hang          never answers                 oom          "CUDA out of memory" on stderr, exit
//   86 spam N        N KiB on stderr, answers ok   exit N       exit(N) without answering fork_hang
//   starts a child that sleeps forever, prints "grandchild <pid>" on stderr, hangs fork_exit N the
//   same, then exit(N)        two_lines    answers with two lines at once close_stdin   closes its
//   stdin, answers ok, hangs fail MESSAGE  MESSAGE on stderr, exit(1)
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

namespace {

constexpr int kExitOutOfMemory = 86;  // as in harness/worker_pool.h

[[noreturn]] void hang() {
  for (;;) pause();
}

void start_sleeping_grandchild() {
  const pid_t child = fork();
  if (child == 0) hang();
  std::fprintf(stderr, "grandchild %d\n", static_cast<int>(child));
  std::fflush(stderr);
}

}  // namespace

int main() {
  const rlimit no_core{0, 0};
  setrlimit(RLIMIT_CORE, &no_core);  // crashing is this program's job; dumping cores is not
  std::string line;
  while (std::getline(std::cin, line)) {
    const size_t space = line.find(' ');
    const std::string command = line.substr(0, space);
    const std::string arg = space == std::string::npos ? "" : line.substr(space + 1);
    if (command == "echo") {
      std::cout << arg << std::endl;
    } else if (command == "env") {
      const char* value = std::getenv(arg.c_str());
      std::cout << (value != nullptr ? value : "<unset>") << std::endl;
    } else if (command == "segv") {
      std::raise(SIGSEGV);
    } else if (command == "abort") {
      std::abort();
    } else if (command == "hang") {
      hang();
    } else if (command == "oom") {
      std::fprintf(stderr, "RuntimeError: CUDA out of memory\n");
      std::exit(kExitOutOfMemory);
    } else if (command == "spam") {
      const std::string kib(1023, 'x');
      for (int i = 0, n = std::atoi(arg.c_str()); i < n; ++i)
        std::fprintf(stderr, "%s\n", kib.c_str());
      std::fflush(stderr);
      std::cout << "ok" << std::endl;
    } else if (command == "exit") {
      std::exit(std::atoi(arg.c_str()));
    } else if (command == "fork_hang") {
      start_sleeping_grandchild();
      hang();
    } else if (command == "fork_exit") {
      start_sleeping_grandchild();
      std::exit(std::atoi(arg.c_str()));
    } else if (command == "two_lines") {
      std::cout << "a\nb" << std::endl;
    } else if (command == "fail") {
      std::fprintf(stderr, "%s\n", arg.c_str());
      std::exit(1);
    } else if (command == "close_stdin") {
      close(0);
      std::cout << "ok" << std::endl;
      hang();
    } else {
      std::cout << "unknown command: " << command << std::endl;
    }
  }
  return 0;
}
