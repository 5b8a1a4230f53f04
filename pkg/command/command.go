// Package command runs the tools the driver drives (mkfs, cp, resize2fs,
// xfs_quota, ...) without a shell, and makes their failures say what ran
// and what the tool said, which is where these tools explain.
package command

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"
)

// maxOutput bounds how much of a tool's output goes into an error.
const maxOutput = 4096

// Error is a command that failed.
type Error struct {
	Line   string // the command and its arguments
	Err    error  // how it ended (*exec.ExitError), or why it did not start
	Output string // its standard error, or standard output when that is empty; bounded
}

func (e *Error) Error() string {
	if e.Output == "" {
		return fmt.Sprintf("%s: %v", e.Line, e.Err)
	}
	return fmt.Sprintf("%s: %v: %s", e.Line, e.Err, e.Output)
}

func (e *Error) Unwrap() error { return e.Err }

// Output runs name with args and returns what it wrote to standard output
// and standard error, whether it failed or not (some tools report errors
// on standard error with exit status 0). A failure is an *Error.
func Output(ctx context.Context, name string, args ...string) (stdout, stderr []byte, err error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		said := strings.TrimSpace(errb.String())
		if said == "" {
			said = strings.TrimSpace(out.String())
		}
		if len(said) > maxOutput {
			said = said[:maxOutput] + "..."
		}
		return out.Bytes(), errb.Bytes(), &Error{Line: strings.Join(append([]string{name}, args...), " "), Err: err, Output: said}
	}
	return out.Bytes(), errb.Bytes(), nil
}

// Run is Output for tools whose standard error matters only when they fail.
func Run(ctx context.Context, name string, args ...string) ([]byte, error) {
	out, _, err := Output(ctx, name, args...)
	return out, err
}
