/* A C caller of the helper library (tests/c_abi.rs builds and drives it): the first line of
 * stdin is the config; then each "status" line prints the status JSON, and "stop" (or the end
 * of stdin) stops the helper, prints "stopped" and exits. */
#include <stdio.h>
#include <string.h>

#include "tether_helper.h"

int main(void) {
    char line[4096];
    if (!fgets(line, sizeof line, stdin)) {
        return 2;
    }
    char *error = NULL;
    TetherHelper *helper = tether_helper_start(line, &error);
    if (!helper) {
        printf("error: %s\n", error ? error : "(none)");
        tether_string_free(error);
        return 1;
    }
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "status", 6) == 0) {
            char *status = tether_helper_status(helper);
            printf("%s\n", status);
            fflush(stdout);
            tether_string_free(status);
        } else if (strncmp(line, "stop", 4) == 0) {
            break;
        }
    }
    tether_helper_stop(helper);
    printf("stopped\n");
    return 0;
}
