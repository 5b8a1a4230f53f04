package command

import (
	"context"
	"errors"
	"os/exec"
	"strings"
	"testing"
)

func TestRun(t *testing.T) {
	tests := []struct {
		name     string
		args     []string
		wantOut  string
		wantErr  bool
		errParts []string
	}{
		{"prints", []string{"-c", "echo hello"}, "hello\n", false, nil},
		{"fails, says why on stderr", []string{"-c", "echo partial; echo broken >&2; exit 3"}, "partial\n", true,
			[]string{"sh -c", "exit status 3", "broken"}},
		{"fails, says why on stdout only", []string{"-c", "echo only-stdout; exit 1"}, "only-stdout\n", true,
			[]string{"exit status 1", "only-stdout"}},
		{"long output is bounded", []string{"-c", "head -c 10000 /dev/zero | tr '\\0' x >&2; exit 1"}, "", true,
			[]string{"..."}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, err := Run(context.Background(), "sh", tt.args...)
			if string(out) != tt.wantOut {
				t.Errorf("stdout %q, want %q", out, tt.wantOut)
			}
			if (err != nil) != tt.wantErr {
				t.Fatalf("err %v, want an error: %t", err, tt.wantErr)
			}
			if err == nil {
				return
			}
			for _, p := range tt.errParts {
				if !strings.Contains(err.Error(), p) {
					t.Errorf("error %q lacks %q", err, p)
				}
			}
			if len(err.Error()) > maxOutput+200 {
				t.Errorf("error of %d bytes", len(err.Error()))
			}
			var exit *exec.ExitError
			if !errors.As(err, &exit) {
				t.Errorf("error %v does not unwrap to the exit status", err)
			}
		})
	}
}

func TestOutputKeepsStderrOfASuccess(t *testing.T) {
	_, stderr, err := Output(context.Background(), "sh", "-c", "echo warned >&2")
	if err != nil || string(stderr) != "warned\n" {
		t.Fatalf("stderr %q, err %v", stderr, err)
	}
}

func TestMissingToolSaysWhich(t *testing.T) {
	_, err := Run(context.Background(), "no-such-tool-here", "x")
	if err == nil || !strings.Contains(err.Error(), "no-such-tool-here x") {
		t.Fatalf("err %v", err)
	}
}
